"""The `pdserve` command line (`main`) and its `serve` subcommand (`serve`), above every
other package: it builds its subcommands from `cluster` and `bench` alike.
`python -m cluster.cli` runs it (`__main__`)."""
