"""One module per algorithm: its Strategy, its client, its wire keys."""
