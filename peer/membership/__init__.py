"""Who is in the swarm: one session per peer pair, heartbeats and failure detection, reconnect with
backoff, signed peer records exchanged between peers, and mDNS discovery on the local link."""
