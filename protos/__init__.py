"""The wire contract (specserve.proto) and its generated modules. Never edit *_pb2*.py."""
