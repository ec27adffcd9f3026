"""The `streamalloc` command of the wheel: runs the CLI binary bundled in the package
(`streamalloc/bin/streamalloc`, built by scripts/build-python.sh), so that `pip install` gives
`streamalloc replay`, `import`, `plot`... without a Rust toolchain."""

import os
import pathlib
import sys


def binary():
    """The path of the bundled `streamalloc` binary."""
    return pathlib.Path(__file__).with_name("bin") / "streamalloc"


def main():
    """Replaces this process by the bundled binary with the same arguments."""
    path = binary()
    if not os.access(path, os.X_OK):
        sys.stderr.write(f"error: the streamalloc command is not in this installation ({path} is missing)\n")
        return 1
    os.execv(path, [str(path), *sys.argv[1:]])
    return 1  # execv does not return


if __name__ == "__main__":
    sys.exit(main())
