"""`python -m plane ...`: the `plane` command where no entry point is installed (a bare GPU
box with the project on PYTHONPATH: scripts/gpu_plane.sh, scripts/gpu_shapes.py,
benchmarks/plane_vs_floor.py)."""

from plane.app import main

main(prog_name="plane")
