"""Video generators (flow-matching text-to-video models) as policies."""
