"""The front end: parse a spec to an AST, check it and resolve it to a Program."""
