"""Subcommands beyond the daemon's core: `peer export` writes a trained model out of a home directory."""

from __future__ import annotations

from pathlib import Path


def cmd_export(args) -> int:
    """Copy the trainer's latest checkpoint into a standalone file (model state dict + how it was made).

    If a daemon is running on that home it is asked to checkpoint first, so the export is current.
    """
    import io

    import torch

    from peer.control import ControlError, call
    from peer.home import Home, atomic_write
    from peertrain.checkpoints import read_checkpoint

    home = Home(Path(args.home).expanduser())
    try:
        call(home.root, "checkpoint", timeout=30)
    except ControlError:
        pass  # no daemon running (or no trainer): export what is on disk
    path = home.latest_checkpoint
    if not path.exists():
        raise ValueError(f"no checkpoint in {home.checkpoints}; has a trainer run with this home?")
    ckpt = read_checkpoint(path)  # data only: a checkpoint that would run code is refused (ValueError)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise ValueError(f"{path} is not a trainer checkpoint (no 'model' state dict)")
    out = {"model_name": ckpt.get("model_name"), "state_dict": ckpt["model"], "step": ckpt.get("step"),
           "options": ckpt.get("options", {})}
    buf = io.BytesIO()
    torch.save(out, buf)
    atomic_write(Path(args.output), buf.getvalue())
    print(f"wrote {args.output}: model {out['model_name']} at step {out['step']} "
          f"({sum(t.numel() for t in out['state_dict'].values())} parameters)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="write the trained model of a home directory to a .pt file",
                       description="Write the latest model of a daemon's trainer to OUTPUT (torch.save of "
                                   "{'model_name', 'state_dict', 'step', 'options'}). Load it with "
                                   "trainers.models.build_model(model_name).load_state_dict(state_dict).")
    p.add_argument("--home", metavar="DIR", required=True, help="the daemon's home directory")
    p.add_argument("output", metavar="OUTPUT", help="file to write, e.g. model.pt")
    p.set_defaults(fn=cmd_export)
