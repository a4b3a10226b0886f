from prorl_cli.cli import main

main()
