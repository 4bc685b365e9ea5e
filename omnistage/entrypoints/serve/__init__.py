"""HTTP plumbing shared by the server's routers: auth, dependencies, error mapping, control routes."""
