from bunkhouse.cli import main

raise SystemExit(main())
