"""The worker library: what runs inside a rank process (a training script imports it through ``ftrun``)."""
