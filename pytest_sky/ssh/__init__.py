"""SSH pieces shared by every backend: keys, config files, the client and parallel runs."""
