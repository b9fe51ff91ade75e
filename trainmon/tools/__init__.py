"""The offline side: the ``trainmon`` command, one module per subcommand, and the readers they share.
Nothing imports them."""
