"""HTTP adapters, one module per dialect; both thin over `gateway/`."""
