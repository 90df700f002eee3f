"""Memory counters: the ledger of piles per storage, gradients and pile watching at a close,
the CUDA allocator's counters and history, NVML and the host's readers."""
