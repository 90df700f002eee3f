"""Children the viewer starts for `memtui estimate`: a parameter count on the meta device
(`count_params`) and one training step on fake tensors (`fake_step`)."""
