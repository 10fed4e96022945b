"""The speculative decoding algorithm: no Ray, no gRPC."""
