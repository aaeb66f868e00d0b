"""`make gpu-check`: proves a GPU node with xscale's own trainers (docs/GPU-CHECK.md)."""
