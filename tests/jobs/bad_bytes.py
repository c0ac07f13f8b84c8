"""Writes bytes that are not UTF-8 to stdout and stderr (as a C library or a binary dump can): the launcher,
the logs and the CLI must show them as replacement characters, never crash. `--fail`: then exit 3."""
import os
import sys

rank = os.environ.get("RANK", "0").encode()
sys.stdout.buffer.write(b"rank " + rank + b" caf\xe9 \xff\xfe out\n")
sys.stdout.buffer.flush()
sys.stderr.buffer.write(b"rank " + rank + b" \xc3\x28 err\n")
sys.stderr.buffer.write(b"no newline \x80")  # a last line cut short, mid-character
sys.stderr.buffer.flush()
if "--fail" in sys.argv:
    sys.exit(3)
