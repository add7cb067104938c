"""The ops: one module per op family (public function, pure-PyTorch reference, custom op); ARCHITECTURE.md."""
