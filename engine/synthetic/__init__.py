"""Random-weight models of real architectures at their real sizes (``twostroke synthesize``).

What such a model is for is in ``docs/models.md``: speed and memory at real sizes, never
quality.
"""
