"""Pure parsers by the tool whose output they read (captures in tests/fixtures/ and ../shared/fixtures/)."""
