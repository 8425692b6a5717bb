from service.cli.main import main

raise SystemExit(main())
