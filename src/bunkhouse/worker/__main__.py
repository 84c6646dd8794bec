from bunkhouse.worker.main import main

raise SystemExit(main())
