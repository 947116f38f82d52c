"""The CPU kernels twostroke compiles for the machine it runs on, their build and their choice."""
