"""The wire protocol's version, in a module of its own: the run record (protocol/records.py) and the
frames (protocol/frames.py) both carry it, and the command line reads the records' schema without
importing torch (a refused flag answers in a fraction of a second)."""

PROTOCOL_VERSION = 1
