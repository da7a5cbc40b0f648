from kafila.cli import main

raise SystemExit(main())
