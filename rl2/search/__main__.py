from rl2.search.run import main

main()
