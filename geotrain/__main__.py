from geotrain.cli import main

raise SystemExit(main())
