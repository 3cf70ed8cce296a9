"""corral's benches: `python -m bench {load,overhead,swap,scheduler}` (see bench/README.md)."""
