"""The `peer` command line (`main.py`) and what it shows: status views, `peer local`, `peer export`."""
