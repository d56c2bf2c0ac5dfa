"""Prometheus metrics (`[metrics] listen`): a per-daemon registry whose collector reads the daemon's state
at scrape time, served by a small trio HTTP server in the daemon's nursery (see
docs/design.md, "Metrics for Prometheus"). Only service.py and collector.py import prometheus_client, and
only a daemon with `[metrics] listen` set imports them."""
