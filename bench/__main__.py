"""python -m bench {load,overhead,swap,scheduler,tokenize,chaos} [options]; --help on each."""

from __future__ import annotations

import sys

from bench import chaos, load, overhead, scheduler, swap, tokenize_rate

COMMANDS = {"load": load.main, "overhead": overhead.main, "swap": swap.main,
            "scheduler": scheduler.main, "tokenize": tokenize_rate.main, "chaos": chaos.main}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m bench {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
