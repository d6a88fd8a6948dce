"""What a run keeps on disk to continue after a crash: its checkpoint file."""
