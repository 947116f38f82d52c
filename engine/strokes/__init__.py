"""What the engine's two strokes do beside their loops: launching a step, delivering its output."""
