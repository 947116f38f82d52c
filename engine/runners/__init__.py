"""Model runners: the protocol the forward stroke drives, the torch and toy runners, the sampler."""
