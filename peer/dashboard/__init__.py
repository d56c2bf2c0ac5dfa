"""The dashboard (`[dashboard] listen`): a read-only web page of this daemon's view of the swarm, served with
its JSON feed by the daemon's bounded HTTP server (peer/metrics/http.py). feed.py trims the daemon's status
(the one `peer status` reads) to a bounded feed; service.py owns the listener; static/ is the page. See
docs/design.md, "Dashboard"."""
