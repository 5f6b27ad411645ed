"""Bridges to other training libraries. Each module needs its own extra (`pip install -e .[trl]` for `trl`);
`import llamagym` never imports them."""
