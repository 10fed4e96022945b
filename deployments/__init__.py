"""Ray Serve applications and the gRPC glue between the router and the pools."""
