"""The artifact cache: what is converted or compiled once, on disk, and read back by later runs."""
