"""xscale: the shared library of the trainers in python/ (one module per concern).

Trainers run as `python python/NAME.py`, so python/ is on sys.path and this package imports
as `xscale`; nothing here is installed. Import the modules you need (`from xscale import dist`).
"""
