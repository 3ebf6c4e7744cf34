from mlautotune.cli import main

main()
