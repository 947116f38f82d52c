"""Pure scheduling logic."""
