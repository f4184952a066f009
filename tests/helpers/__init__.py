"""What several test modules share (never imported from another test module)."""
