"""Optional services a daemon hosts beside membership (topology, gossip, pipeline, a trainer, metrics).

The daemon knows services only through this small interface, and learns which trainer to load from the
config: `peer/` never imports a specific trainer. A service has `name`, `async run(task_status=...)`, and
may have `status() -> dict` (merged into `peer status --json` under its name), `commands() -> dict`
(extra control-socket commands), `sessions() -> dict` (control commands that keep their connection),
`training() -> dict | None` (figures for `peer status`'s training panel when no trainer is hosted) and `async shutdown()` (save state before the daemon stops).
"""

from __future__ import annotations


def load_services(daemon) -> list:
    """The services this daemon's config asks for, in start order."""
    from peer.attach.service import AttachService
    from peer.averaging.engine import GossipEngine
    from peer.nat.service import NatService
    from peer.pipeline.service import PipelineService
    from peer.topology.service import TopologyService

    nat = daemon.nat = NatService(daemon)
    topology = TopologyService(daemon)
    gossip = GossipEngine(daemon, topology)
    pipeline = PipelineService(daemon, topology)
    daemon.topology, daemon.gossip, daemon.pipeline = topology, gossip, pipeline
    services = [nat, topology, gossip, pipeline, AttachService(daemon, gossip)]
    if daemon.config.trainer.name:
        from peer.trainer_host import TrainerHost

        services.append(TrainerHost(daemon, gossip))
    if daemon.config.metrics.listen:
        from peer.metrics.service import MetricsService  # prometheus_client is only imported when asked for

        services.append(MetricsService(daemon))
    return services
