"""The native engine's backend on PJRT plugin devices (GPU, TPU): probe, copies, staging."""
