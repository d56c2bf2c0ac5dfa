"""Being reachable across the internet: reachability by dial-back, relays for peers behind NAT, hole
punching, and the explanations `peer doctor` and the logs give. See docs/design.md, "Across the internet"."""
