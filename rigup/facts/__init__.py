"""pyinfra facts by tool (read-only commands on the rig); their parsers are in rigup/parsers/."""
