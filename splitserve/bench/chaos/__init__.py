"""`splitserve bench chaos`: a randomized fault campaign with invariants (main.py)."""
