"""Ray only (no torch, no models): connect to a cluster, place workers, run a function on them."""
