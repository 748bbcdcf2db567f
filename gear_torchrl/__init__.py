"""gear_torchrl: GPU-centric experience replay as TorchRL storage and sampler backends."""
