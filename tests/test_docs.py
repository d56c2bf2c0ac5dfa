"""The README's config reference is generated from the config fields' docs; keep them in sync."""

from pathlib import Path

from peer.config import docs_markdown


def test_readme_config_table_matches_the_code():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert docs_markdown() in readme, "regenerate the README's config table with `peer config docs`"


def test_every_cli_command_is_in_the_readme():
    from peer.cli.main import build_parser

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"`peer {name}" in readme, name
