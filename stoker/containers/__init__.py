"""The Docker engine: stoker's containers, and running one pipeline step inside an image."""
