"""pyinfra operations by tool, mirroring rigup/facts/: each yields only the commands that close a gap."""
