module example.com/go-controller

go 1.19
