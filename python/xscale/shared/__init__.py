"""What the batch host shares with the ranks: every file, event, message and variable they
exchange (contract), every XSCALE_* setting (settings), the reader of XSCALE_* lines (taglines)
and a tarball unpacked atomically (archive). Python 3.6 and the standard library only, importing
nothing else from xscale: jobs/lib/shared.py loads these files by path, where the package itself
does not import. This file stays empty of imports for the same reason."""
